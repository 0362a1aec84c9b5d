"""The one harness every test and benchmark uses: the processes of a run (processes, pipeline), a
run's config (configs), what a test writes to Redis (groups, models), what it reads back (metrics,
audit), a real Redis (servers), and what a test needs of the machine (needs). Fixtures are in
tests/conftest.py; a test module never imports another."""
