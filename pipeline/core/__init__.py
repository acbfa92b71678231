"""Shared pieces every stage stands on: config, errors, records, artifact layout, files, reports."""
