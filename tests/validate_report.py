#!/usr/bin/python3
"""Validates a trainscope report against reports/schema/report.schema.json (Debian's python3-jsonschema).

Usage: validate_report.py SCHEMA REPORT   -> exit 0 when valid, 1 with the first error otherwise.
"""
import json
import sys

import jsonschema

schema = json.load(open(sys.argv[1]))
report = json.load(open(sys.argv[2]))
validator_class = jsonschema.validators.validator_for(schema)
validator_class.check_schema(schema)
errors = sorted(validator_class(schema).iter_errors(report), key=lambda e: list(e.path))
if errors:
    e = errors[0]
    print(f"invalid: {'/'.join(map(str, e.path))}: {e.message}")
    sys.exit(1)
print("valid")
