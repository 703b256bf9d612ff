"""Prefect tasks: thin wrappers around ktflow engine functions.

Each task adds what Prefect is for (cache policy keyed on input manifest hashes plus
``ktflow.ENGINE_VERSION``, retries on transient errors, logging, progress and artifacts)
and nothing else: no format logic lives here. One module per stage, named after it.
"""
