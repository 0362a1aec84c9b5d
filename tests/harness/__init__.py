"""The one harness every test uses: the processes of a run (processes, pipeline), a
run's config (configs), what a test writes to Redis (groups, models), what it reads back (metrics,
audit), a real Redis (servers), and what a test needs of the machine (needs). What the benchmarks
use too lives below both, in common/ and ops/lib/ (ops/ imports nothing of tests/); the harness's
modules hand it on under the same names. Fixtures are in tests/conftest.py; a test module never
imports another."""
