"""The `kfac-stream train` application: Hydra configs, data, models, monitoring, report."""
