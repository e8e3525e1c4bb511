"""Optional backends; each imports its heavy dependency only when constructed."""
