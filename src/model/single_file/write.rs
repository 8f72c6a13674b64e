//! Writing single-file checkpoints (placeholder).
