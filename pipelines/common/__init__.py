"""What every product shares and none owns: the settings kit, exit statuses, Ray, corpus rows,
sources and object storage (see pipelines/__init__.py)."""
