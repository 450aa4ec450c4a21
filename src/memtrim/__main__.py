from memtrim.cli import main

raise SystemExit(main())
