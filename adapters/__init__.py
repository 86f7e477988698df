"""Adapters that put the paged store to work: the transformers cache and the scheduler.

They land with their own issues; the package exists so that ``kvlib.adapters`` is the stable
import path they will have.
"""
