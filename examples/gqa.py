"""Grouped-query attention: H = HKV * 4 query heads, every 4 consecutive query heads share one kv head."""

import falower as fl

graph = fl.attention(group_size=4, name="gqa")
