"""``python -m kfac_stream.app``: the Hydra main job (`kfac_stream.app.main`), as
``kfac-stream train`` runs it."""

from .main import cli_main

if __name__ == "__main__":
    cli_main()
