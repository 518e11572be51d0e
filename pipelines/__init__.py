"""The compression job (Ray Data) built on mist_core; entry point: pipelines.compress."""
