"""Small helpers every layer may use: the option enums, factor key names, local-file checks,
log set-up, progress bars and the tracker's own random generators."""
