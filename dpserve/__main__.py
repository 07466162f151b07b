from dpserve.cli import main

raise SystemExit(main())
