"""Rules, one module each, registered in RULES."""
