"""Training drafts for a target: self-distillation data, EAGLE heads and distilled draft models."""
