"""Stage configs: one file per stage, `get_config(arg)` returning an ml_collections.ConfigDict."""
