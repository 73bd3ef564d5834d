"""Token datasets: ``hpcx data prepare`` (text → token shards + manifest) and ``hpcx data verify``.

Torch-free. ``tokenizers``, ``pyarrow``, ``zstandard`` and ``jinja2`` (chat templates,
``hpc.data.chat``) are imported only where a command needs them. Layout of a prepared folder::

    DIR/manifest.json                 what the trainer reads (written last, atomically)
    DIR/train-GGGGG-KKKK.bin          tokens of group G, shard K (uint16 or uint32)
    DIR/train-GGGGG-KKKK.idx          uint64 document offsets into the shard (documents + 1)
    DIR/train-GGGGG-KKKK.mask         uint8 per token, 1 where the loss counts (prompt-response only)
    DIR/val-…                         the same for the validation split
    DIR/.prepare/plan.json            the inputs, groups and options of this preparation
    DIR/.prepare/group-GGGGG.json     one finished group (its shards with their hashes)
"""
