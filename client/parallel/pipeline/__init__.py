"""Pipeline parallelism: schedules as data (GPipe, 1F1B, interleaved 1F1B) and their executor."""
