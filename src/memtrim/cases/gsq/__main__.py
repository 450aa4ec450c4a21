from memtrim.cases.gsq.cli import main

raise SystemExit(main())
