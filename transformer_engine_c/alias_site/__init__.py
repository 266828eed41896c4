"""The directory TEC_AS_TRANSFORMER_ENGINE=1 puts first on PYTHONPATH (its
sitecustomize installs the alias); nothing here is imported as a package."""
