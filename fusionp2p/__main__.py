"""``python -m fusionp2p`` runs the CLI."""

from fusionp2p.cli import main

raise SystemExit(main())
