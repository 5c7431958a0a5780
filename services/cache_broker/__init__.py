"""Cache broker: the index of which sender holds which context; answers lookups."""
