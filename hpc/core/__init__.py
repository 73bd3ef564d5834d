"""What the login node and the job share, torch-free: specs and sites (strict config, input policy),
the parallel layout (``dims``), model facts per family (``models``), the resolved ``Launch``, run
folders, requeue policy, process helpers and the user error.

Imported by every side (``hpcx`` commands, the batch script's check, each trainer rank). It imports no
torch, no login tool (``hpc.login``, ``hpc.plan``, ``hpc.cli``, ``hpc.scale``) and no scheduler
implementation: it asks the registry ``hpc.schedulers`` by kind. ``tests/test_layers.py`` checks it.
"""
