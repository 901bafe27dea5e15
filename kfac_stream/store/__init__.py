"""Owner-side CPU storage of the EMA factors."""
