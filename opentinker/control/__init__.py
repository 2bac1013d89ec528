"""Control: the coordinator, launching components, and checkpoints (decides what runs next)."""
