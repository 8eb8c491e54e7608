"""User-facing layer: pipeline, request gateway, chat templates, detokenizer."""
