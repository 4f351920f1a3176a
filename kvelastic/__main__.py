from kvelastic.cli import main

raise SystemExit(main())
