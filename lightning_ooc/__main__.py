from lightning_ooc.cli import main

raise SystemExit(main())
