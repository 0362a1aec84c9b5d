"""`rollouts check`: before a long run, whether the generators' samples and the trainer agree.

Not a process of the run: a one-off that plays both sides on the run's own config, so it may use
generator, trainer and producer code alike (`tests/test_layout.py`); nothing imports it.
"""
