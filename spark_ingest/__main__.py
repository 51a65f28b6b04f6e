"""``python -m spark_ingest --landing DIR --table DIR --checkpoint DIR``: see :func:`spark_ingest.job.main`."""

import sys

from spark_ingest.job import main

sys.exit(main())
