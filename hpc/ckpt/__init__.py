"""Checkpoint formats, read and written one tensor at a time; the work behind ``hpcx ckpt``.

Three formats share one flat view (``entries.Entry``, keyed like DCP's flattened state
dict): DCP folders (``dcp``), safetensors files or shard sets (``safetensors``) and single
``torch.save`` files (``torchsave``), each one row of the table ``formats`` (how it is recognized,
its reader and writer, how ``checkpoint.init_from`` reads it). Imports point one way::

    cli ──► convert ──► formats ──► dcp, safetensors, torchsave ──► entries, outputs, torch_zip, safe_pickle, files
                                                               └──► hpc.compat, hpc.core.errors

Nothing here imports ``trainer`` (the trainer imports this package for its DCP reader and
allow-list unpickler), and importing ``hpc.ckpt``, ``hpc.ckpt.formats``, ``hpc.ckpt.files`` or
``hpc.cli.ckpt`` does not import torch: every other module of the package does, so the CLI imports
them inside its commands.
A checkpoint that is missing, torn, corrupt or lying raises ``hpc.core.errors.CheckpointError``.
"""
