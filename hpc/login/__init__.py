"""Login-node tools, torch-free: render a job's script (``render``), submit it into a new run folder
(``submit``), remember run roots (``roots``), rehearse a preemption (``drill``), read NCCL traces (``nccl``).

Imported by the commands (``hpc.cli``) and scaling studies (``hpc.scale``); never by the job.
"""
