"""The task contract between gateways, Celery clients and workers.

Import-light on purpose: nothing here imports torch, and only
`tasks.client` imports Celery.
"""
