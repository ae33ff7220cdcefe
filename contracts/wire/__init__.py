"""The wire between workers and the control plane (pure Python: no Django, no torch)."""
