"""hpcx trainer: runs inside the job, one process per rank."""
