from prefpack.cli import main

raise SystemExit(main())
