"""Local mode: run Tandem's processes on one machine (`tandem up`)."""
