"""Snapshots: checkpoints, the snapshot store and its converter, boot templates and warm pools."""
