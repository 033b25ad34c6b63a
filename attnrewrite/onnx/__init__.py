"""ONNX frontend: load, find attention sites, splice replacements, validate, save."""

from attnrewrite.onnx.rewrite import analyze, find_sites, read_record, rewrite_model

__all__ = ["analyze", "find_sites", "read_record", "rewrite_model"]
