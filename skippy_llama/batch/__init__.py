"""Batch prompt processing (``skippy-llama batch``): items, prefix-sharing order, resumable output.

Everything here but :mod:`.runner` is plain Python without a model, so the input checks, the
order and the resume logic are unit-tested on their own.
"""

from .items import BatchItem, load_items
from .order import prefix_order
from .output import OutputFile

__all__ = ["BatchItem", "OutputFile", "load_items", "prefix_order"]
