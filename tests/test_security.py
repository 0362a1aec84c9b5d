"""Security: the pipeline against a Redis that requires a password, every process signed in over
TLS as an ACL user that may touch only its run's keys (and RQ's), its password percent-encoded in
the URL; a missing or wrong password stops each process with one line that says so and never
shows the password."""

import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from common.keys import Keys
from tests.harness.configs import write_config
from tests.harness.processes import ROOT, spawn, stop, wait_for
from tests.harness.servers import free_port, start_redis

RUN = "sec"
KEYS = Keys(RUN)
PASSWORD = "default-pw-7f3a"  # the default user's (requirepass)
USER, USER_PASSWORD = "rollouts-sec", "acl-pw-91c2"
# a password with the characters a URL must percent-encode (docs/operations.md: "percent-encode @, : and /")
TLS_PASSWORD = "acl@pw:91/c2"
# docs/operations.md's example: the run's keys, RQ's keys and channels, every command but the dangerous
# ones, plus INFO (RQ reads the server version with it; without it RQ assumes an old server).
ACL_RULE = f"on >{USER_PASSWORD} resetkeys ~rollouts:{RUN}:* ~rq:* resetchannels &rq:* +@all -@dangerous +info"


def tiny_config(tmp_path, model, *, steps: int, eval_every: int) -> str:
    path = tmp_path / "run.toml"
    return write_config(path, run=RUN, output_dir=tmp_path / "run", model=model, trainer={"max_steps": steps},
                        eval={"every": eval_every, "prompts": 4})["ROLLOUTS_CONFIG"]


def locked_redis(tmp_path, *extra: str):
    """A real redis-server that requires PASSWORD, with the ACL user USER; (process, port)."""
    port = free_port()
    server = start_redis(tmp_path / "redis", port, *extra)
    redis.Redis(port=port).config_set("requirepass", PASSWORD)  # as `--requirepass` would
    admin = redis.Redis(port=port, password=PASSWORD)
    admin.execute_command("ACL", "SETUSER", USER, *ACL_RULE.split())
    return server, port


def env(url: str) -> dict[str, str]:
    """The environment for `rollouts` signed in with `url`."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTS_")}, "ROLLOUTS_REDIS_URL": url}


def self_signed(tmp_path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key: the server's, the clients' and the CA."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


def test_pipeline_runs_over_tls_as_an_acl_user_limited_to_its_run(tmp_path, tiny_model):
    cert, key = self_signed(tmp_path)
    tls_port = free_port()
    # docs/operations.md's TLS flags (client certificates required, Redis's default); the plain port is the test's own
    server, port = locked_redis(tmp_path, "--tls-port", str(tls_port), "--tls-cert-file", str(cert),
                                "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert))
    redis.Redis(port=port, password=PASSWORD).execute_command("ACL", "SETUSER", USER, f">{TLS_PASSWORD}")
    password_url = f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
    acl_url = (f"rediss://{USER}:{quote(TLS_PASSWORD, safe='')}@127.0.0.1:{tls_port}/0"
               f"?ssl_ca_certs={cert}&ssl_certfile={cert}&ssl_keyfile={key}")
    r = redis.Redis.from_url(password_url)
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=port).ping()  # nobody gets in without a password
    with pytest.raises(redis.exceptions.ConnectionError):  # nor without TLS on the TLS port
        redis.Redis(port=tls_port, username=USER, password=TLS_PASSWORD, socket_timeout=5).ping()
    config = tiny_config(tmp_path, tiny_model, steps=2, eval_every=1)
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(name: str, module: str, *args: str) -> subprocess.Popen:
        env = {"ROLLOUTS_CONFIG": config, "ROLLOUTS_REDIS_URL": acl_url}
        return spawn(module, *args, cwd=tmp_path, env=env, log=logs / f"{name}.log")

    procs = {"producer": start("producer", "producers"), "generator": start("generator", "generators", "--id", "g1"),
             "trainer": start("trainer", "trainer"), "evaluator": start("evaluator", "evaluator")}
    try:
        assert procs["trainer"].wait(timeout=300) == 0, (logs / "trainer.log").read_text()[-3000:]
        wait_for(lambda: r.hexists(KEYS.evals, "2"), timeout=120, what="the evaluation of version 2",
                 procs=list(procs.values()))
        # every process signed in as the confined user, over TLS (the test's own client is the default user)
        mine, clients = r.client_id(), r.client_list()
        theirs = [c for c in clients if int(c["id"]) != mine]
        assert len(theirs) >= 3 and all(c["user"] == USER and c["laddr"].endswith(f":{tls_port}")
                                        for c in theirs), clients
        # `rollouts status` reads the run as the ACL user, over TLS, too
        status = subprocess.run([sys.executable, "-m", "common.cli", "status", "--config", config],
                                env=env(acl_url), cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert "step 2  version 2" in status.stdout and "eval       v2  pass@1" in status.stdout, status
        # the user really is confined to its run: another run's keys are refused
        with pytest.raises(redis.exceptions.NoPermissionError):
            redis.Redis.from_url(acl_url).set("rollouts:other:producer", 1)
    finally:
        codes = {name: stop(p) for name, p in procs.items()}
        server.kill()
    assert codes == dict.fromkeys(procs, 0), {n: (logs / f"{n}.log").read_text()[-3000:] for n in procs}
    run_config = (tmp_path / "run" / "config.json").read_text()
    for name, text in {**{n: (logs / f"{n}.log").read_text() for n in procs}, "config.json": run_config}.items():
        for secret in (PASSWORD, TLS_PASSWORD, quote(TLS_PASSWORD, safe="")):
            assert secret not in text, f"{name} shows a password"
    assert f"{USER}:***@127.0.0.1:{tls_port}" in run_config


def test_a_missing_or_wrong_password_stops_each_process_with_one_line(tmp_path, tiny_model):
    server, port = locked_redis(tmp_path)
    config = tiny_config(tmp_path, tiny_model, steps=1, eval_every=0)
    bad = {  # process: (module, URL, what Redis says)
        "producer": ("producers", f"redis://127.0.0.1:{port}/0", "Authentication required"),
        "generator": ("generators", f"redis://:wrong-{PASSWORD}@127.0.0.1:{port}/0", "invalid username-password"),
        "trainer": ("trainer", f"redis://{USER}:wrong-{USER_PASSWORD}@127.0.0.1:{port}/0",
                    "invalid username-password"),
        "evaluator": ("evaluator", f"redis://nobody:{PASSWORD}@127.0.0.1:{port}/0", "invalid username-password"),
    }
    procs = {name: spawn(module, cwd=tmp_path, env={"ROLLOUTS_CONFIG": config, "ROLLOUTS_REDIS_URL": url},
                         log=tmp_path / f"{name}.log") for name, (module, url, _) in bad.items()}
    try:
        codes = {name: p.wait(timeout=120) for name, p in procs.items()}
    finally:
        for p in procs.values():
            stop(p)
        server.kill()
    for name, (_, url, said) in bad.items():
        out = (tmp_path / f"{name}.log").read_text()
        assert codes[name] != 0, f"{name} exited {codes[name]}: {out}"
        assert "Traceback" not in out, out
        last = out.strip().splitlines()[-1]
        host = f"127.0.0.1:{port}/0"
        assert re.fullmatch(rf"{name}: Redis at redis://\S*{re.escape(host)} refused the credentials: "
                            rf"{said}.*", last), last
        password = url.split("://")[1].rpartition("@")[0].partition(":")[2]
        if password:
            assert password not in out and ":***@" in last, out


def test_an_acl_user_lacking_a_permission_stops_each_process_with_one_line(tmp_path, tiny_model):
    """Each process, and `rollouts status`, names what Redis refused (a command, a key) in one line
    with the password hidden, and exits non-zero instead of a traceback."""
    server, port = locked_redis(tmp_path)
    admin = redis.Redis(port=port, password=PASSWORD)
    # docs/operations.md's rule but without XADD; and one confined to another run's keys (and not RQ's)
    admin.execute_command("ACL", "SETUSER", "no-xadd", *ACL_RULE.replace(USER_PASSWORD, "pw-1").split(), "-xadd")
    admin.execute_command("ACL", "SETUSER", "other-run", *ACL_RULE.replace(USER_PASSWORD, "pw-2")
                          .replace(f"~rollouts:{RUN}:* ~rq:*", "~rollouts:other:*").split())
    no_xadd = f"redis://no-xadd:pw-1@127.0.0.1:{port}/0"
    other_run = f"redis://other-run:pw-2@127.0.0.1:{port}/0"
    config = tiny_config(tmp_path, tiny_model, steps=1, eval_every=0)
    cases = {  # process: (module, URL, what Redis says)
        "producer": ("producers", no_xadd, "no permissions to run the 'xadd' command"),
        "trainer": ("trainer", other_run, "no permissions to access one of the keys"),
        "generator": ("generators", other_run, "no permissions to access one of the keys"),
        "evaluator": ("evaluator", other_run, "no permissions to access one of the keys"),
    }
    procs = {name: spawn(module, cwd=tmp_path, env={"ROLLOUTS_CONFIG": config, "ROLLOUTS_REDIS_URL": url},
                         log=tmp_path / f"{name}.log") for name, (module, url, _) in cases.items()}
    try:
        codes = {name: p.wait(timeout=120) for name, p in procs.items()}
        status = subprocess.run([sys.executable, "-m", "common.cli", "status", "--config", config],
                                env=env(other_run), cwd=ROOT,
                                capture_output=True, text=True, timeout=60)
    finally:
        for p in procs.values():
            stop(p)
        server.kill()
    outs = {name: (tmp_path / f"{name}.log").read_text() for name in cases}
    outs["rollouts"], codes["rollouts"] = status.stdout + status.stderr, status.returncode
    cases["rollouts"] = (None, other_run, "no permissions to access one of the keys")
    for name, (_, _, said) in cases.items():
        out = outs[name]
        assert codes[name] not in (0, None), f"{name} exited {codes[name]}: {out}"
        assert "Traceback" not in out, out
        last = out.strip().splitlines()[-1]
        host = f"127.0.0.1:{port}/0"
        assert re.fullmatch(rf"{name}: Redis at redis://[\w-]+:\*\*\*@{re.escape(host)} refused a command: "
                            rf".*{re.escape(said)}.*", last), last
        assert "pw-1" not in out and "pw-2" not in out, out


def test_rollouts_status_with_a_wrong_password_says_so_in_one_line(tmp_path, tiny_model):
    server, port = locked_redis(tmp_path)
    config = tiny_config(tmp_path, tiny_model, steps=1, eval_every=0)
    try:
        status = subprocess.run([sys.executable, "-m", "common.cli", "status", "--config", config],
                                env=env(f"redis://{USER}:wrong-pw@127.0.0.1:{port}/0"),
                                cwd=ROOT, capture_output=True, text=True, timeout=60)
    finally:
        server.kill()
    assert status.returncode != 0 and status.stdout == "", status
    assert status.stderr.strip() == (
        f"rollouts: Redis at redis://{USER}:***@127.0.0.1:{port}/0 refused the credentials: invalid "
        "username-password pair or user is disabled. (put the password, or ACL user and password, in redis_url: "
        "redis://user:password@host:port/db)"), status.stderr


def test_the_trainer_refuses_a_model_with_only_pickled_weights(tmp_path, tiny_model, redis_url):
    import shutil

    import torch
    from safetensors.torch import load_file

    model = tmp_path / "pickled"
    shutil.copytree(tiny_model, model)
    [weights] = model.glob("*.safetensors")
    torch.save(load_file(weights), model / "pytorch_model.bin")  # what an old or untrusted checkpoint holds
    weights.unlink()
    config = tiny_config(tmp_path, model, steps=1, eval_every=0)
    proc = spawn("trainer", cwd=tmp_path, env={"ROLLOUTS_CONFIG": config, "ROLLOUTS_REDIS_URL": redis_url},
                 log=tmp_path / "trainer.log")
    code = proc.wait(timeout=120)
    out = (tmp_path / "trainer.log").read_text()
    assert code == 2 and "Traceback" not in out, out
    assert out.strip().splitlines()[-1].startswith(
        f"trainer: model at {model}: no .safetensors weights (pytorch_model.bin); "
        "the trainer loads safetensors only"), out
