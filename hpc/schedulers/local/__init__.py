"""This machine as a scheduler (``kind = "local"``): submitit's local executor on the login side
(``scheduler.LocalScheduler``) and the job side of its tasks (``scheduler.LocalJobSide``).
"""
