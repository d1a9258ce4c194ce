import sys

from compiled_llm.cli import main

sys.exit(main())
