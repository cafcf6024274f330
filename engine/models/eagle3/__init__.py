"""EAGLE-3 draft heads in the published checkpoint format: their config (SpecForge's and
speculators' layouts), the head module, and its checkpoint files."""
