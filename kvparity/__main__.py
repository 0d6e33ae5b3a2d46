from kvparity.reports.cli import main

raise SystemExit(main())
