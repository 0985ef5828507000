"""Optimizers: MuonClip (Muon + QK-Clip for MLA, AdamW for the rest)."""
