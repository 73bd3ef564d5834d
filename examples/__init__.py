"""Worked examples of the task seam (``[task] target``, docs/tasks.md): a job under ``jobs/`` names each.

They are not part of the wheel: a job started from a checkout imports them from the folder it was
submitted from (``hpc.core.imports.submit_folder_last``), as it would your own package.
"""
