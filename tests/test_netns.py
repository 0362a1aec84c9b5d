"""Generators on another machine: two network namespaces on this one stand for two hosts. Redis,
the producer, the trainer and its checkpoint server run on host A; a generator runs on host B and
reaches A over its address only, signed in with a password as an ACL user confined to the run, and
fetches every published version over HTTP into a directory of its own. The run trains."""

import os
import random
import shutil
import subprocess
import sys
import time

import pytest

from tests.harness.configs import write_config
from tests.harness.needs import skip_without_root
from tests.harness.processes import start, stop, wait_for

RUN = "nn"
PASSWORD, USER, USER_PASSWORD = "nn-default-pw", "rollouts-nn", "nn-acl-pw"
ACL_RULE = f"on >{USER_PASSWORD} resetkeys ~rollouts:{RUN}:* ~rq:* resetchannels &rq:* +@all -@dangerous +info"


def sh(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True)


@pytest.fixture
def hosts():
    """Two namespaces joined by a veth pair on a private /30: (name A, address A, name B); root
    only (skipped otherwise, failed in CI: tests.harness.needs.skip_without_root)."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        skip_without_root("network namespaces need root and iproute2's `ip`")
    tag = f"{os.getpid() % 10000}"
    a, b, net = f"rlA{tag}", f"rlB{tag}", f"10.231.{random.randrange(256)}"
    made = sh("ip", "netns", "add", a)
    if made.returncode != 0:
        skip_without_root(f"cannot create a network namespace here: {made.stderr.strip()}")
    try:
        for step in [("ip", "netns", "add", b),
                     ("ip", "link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}"),
                     ("ip", "link", "set", f"va{tag}", "netns", a), ("ip", "link", "set", f"vb{tag}", "netns", b),
                     ("ip", "-n", a, "addr", "add", f"{net}.1/30", "dev", f"va{tag}"),
                     ("ip", "-n", b, "addr", "add", f"{net}.2/30", "dev", f"vb{tag}"),
                     ("ip", "-n", a, "link", "set", f"va{tag}", "up"), ("ip", "-n", b, "link", "set", f"vb{tag}", "up"),
                     ("ip", "-n", a, "link", "set", "lo", "up"), ("ip", "-n", b, "link", "set", "lo", "up")]:
            done = sh(*step)
            if done.returncode != 0:
                skip_without_root(f"`{' '.join(step)}` failed here: {done.stderr.strip()}")
        yield a, f"{net}.1", b
    finally:
        sh("ip", "netns", "del", a)  # takes the veth pair with it
        sh("ip", "netns", "del", b)


def test_a_generator_on_another_host_trains_the_run_over_its_address(tmp_path, tiny_model, hosts):
    a, address, b = hosts
    port, http_port = 6390, 8100  # the namespaces have these to themselves
    logs = tmp_path / "logs"
    logs.mkdir()

    def on(host: str, name: str, argv: list[str], **env: str) -> subprocess.Popen:
        return start(["ip", "netns", "exec", host, *argv], cwd=tmp_path, env=env, log=logs / f"{name}.log")

    redis_server = on(a, "redis", [shutil.which("redis-server"), "--port", str(port), "--bind", address,
                                   "--dir", str(tmp_path), "--appendonly", "yes", "--save", "",
                                   "--requirepass", PASSWORD])

    def cli(*args: str) -> str:
        return sh("ip", "netns", "exec", a, "redis-cli", "-h", address, "-p", str(port), "--no-auth-warning",
                  "-a", PASSWORD, *args).stdout.strip()

    wait_for(lambda: cli("PING") == "PONG", timeout=30, what="redis on host A", procs=[redis_server])
    assert cli("ACL", "SETUSER", USER, *ACL_RULE.split()) == "OK"
    write_config(tmp_path / "run.toml", run=RUN, output_dir=tmp_path / "host_a", model=tiny_model, base={},
                 rollout={"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 6},
                 generator={"engine": "hf", "threads": 1}, trainer={"lr": 1e-3, "max_steps": 2, "threads": 1})
    acl_url = f"redis://{USER}:{USER_PASSWORD}@{address}:{port}/0"
    config = ["--config", str(tmp_path / "run.toml")]
    py = [sys.executable, "-m"]
    procs = {
        "producer": on(a, "producer", [*py, "producers", *config, "--redis_url",
                                       f"redis://:{PASSWORD}@{address}:{port}/0"]),
        "trainer": on(a, "trainer", [*py, "trainer", *config, "--redis_url", acl_url]),
        "server": on(a, "server", [*py, "common.cli", "serve-checkpoints", *config, "--redis_url", acl_url,
                                   "--bind", f"{address}:{http_port}"]),
        # host B: its own output directory; the weights come over HTTP
        "generator": on(b, "generator", [*py, "generators", *config, "--id", "far", "--redis_url", acl_url,
                                         "--output_dir", str(tmp_path / "host_b"),
                                         "--generator.weights_url", f"http://{address}:{http_port}"]),
    }
    try:
        assert procs["trainer"].wait(timeout=400) == 0, (logs / "trainer.log").read_text()[-3000:]
        fetched = tmp_path / "host_b" / "fetched"
        wait_for(lambda: fetched.is_dir() and any(fetched.glob("step_*")), timeout=60,
                 what="a version fetched over HTTP on host B", procs=[procs["generator"]])
        time.sleep(1.0)
    finally:
        codes = {name: stop(p) for name, p in procs.items()}
        stop(redis_server)
    out = {name: (logs / f"{name}.log").read_text() for name in procs}
    assert "step    2" in out["trainer"], out["trainer"][-2000:]
    assert "loaded weights version" in out["generator"], out["generator"][-2000:]
    assert codes["generator"] == 0, out["generator"][-2000:]
    for name, text in out.items():
        assert PASSWORD not in text and USER_PASSWORD not in text, f"{name} logged a password"
    # host B cannot reach anything of A but its address: no route to A's loopback
    assert sh("ip", "netns", "exec", b, "redis-cli", "-h", "127.0.0.1", "-p", str(port), "PING").stdout.strip() != \
        "PONG"


def veth(host: str) -> str:
    """The name of `host`'s end of the veth pair (its one interface besides lo)."""
    links = sh("ip", "-n", host, "-o", "link").stdout.splitlines()
    names = [line.split(":")[1].strip().split("@")[0] for line in links]
    [name] = [n for n in names if n != "lo"]
    return name


def test_two_trainer_hosts_that_do_not_share_the_output_directory_are_refused_at_start_up(tmp_path, tiny_model,
                                                                                        hosts):
    # Each rank writes its shards of the trainer state into output_dir and rank 0 renames them:
    # a second host with a directory of its own would leave its shards where resume never looks.
    a, address, b = hosts
    logs = tmp_path / "logs"
    logs.mkdir()
    write_config(tmp_path / "run.toml", run=RUN, redis_url=f"redis://{address}:6391/0", model=tiny_model, base={},
                 rollout={"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 6},
                 trainer={"max_steps": 2, "threads": 1})
    ranks = {}
    for node, (host, out) in enumerate([(a, "host_a"), (b, "host_b")]):
        argv = ["ip", "netns", "exec", host, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--node-rank", str(node), "--nproc-per-node", "1", "--master-addr", address, "--master-port", "29511",
                "-m", "trainer", "--config", str(tmp_path / "run.toml"), "--output_dir", str(tmp_path / out)]
        ranks[host] = start(argv, cwd=tmp_path, env={"GLOO_SOCKET_IFNAME": veth(host)}, log=logs / f"{out}.log")
    try:
        codes = [p.wait(timeout=300) for p in ranks.values()]
    finally:
        for p in ranks.values():
            stop(p)
    out = (logs / "host_a.log").read_text()
    assert all(code != 0 for code in codes), out
    host = os.uname().nodename
    assert (f"rank 1 on {host} does not see in {tmp_path / 'host_b'} what rank 0 on {host} wrote in "
            f"{tmp_path / 'host_a'}") in out, out
    assert "needs the same output_dir" in out, out
    # refused before anything was trained or saved
    assert not (tmp_path / "host_a" / "trainer_state").exists() and "step    1" not in out
