"""Where crashed writes leave debris next to checkpoints and recovery snapshots, for `tinkerd fsck`.

Every checkpoint, snapshot and copy is put through the ArtifactStore (tinkerd/artifacts.py); the
local store writes `.<name>.tmp-*` and renames it into place, setting an existing one aside to
`.<name>.old-*/ckpt`. A process killed mid-write leaves those behind: never a half file under the
real name, but disk space nobody frees. The store sweeps them (`sweep_incomplete`)

- at server start and after every engine restart (Recovery.rebuild_engine, before the replay):
  then no engine write can be running, since no engine is in a step; a copy_weights in progress in
  this process is the store's own write, which it skips;
- by the checkpoint sweeper, for temp dirs older than an hour (Checkpoints.sweep_stale_temp);

and `tinkerd fsck --repair` finds them on a stopped server's data directory by these patterns.
"""

from __future__ import annotations

# Relative to checkpoints/: <model>/<segment>/.<name>.* for named checkpoints, _ephemeral/.<id>.* for samplers.
CHECKPOINT_TEMP = ("*/*/.*.tmp-*", "*/*/.*.old-*", "*/.*.tmp-*", "*/.*.old-*")
# Relative to snapshots/: <model_id>/.seq-<n>.tmp-* (engine/snapshots.py: write).
SNAPSHOT_TEMP = ("*/.*.tmp-*", "*/.*.old-*")
