"""``python -m fusionp2p`` runs the CLI."""

from fusionp2p.cli import main

if __name__ == "__main__":  # not when a child process (the coordinator's tracer) imports it
    raise SystemExit(main())
