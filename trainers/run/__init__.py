"""A run's files in its output_dir: checkpoints, the manifest of what rlspec wrote, the lease lock, and the
signals that stop a run cleanly (docs/resume.md)."""
