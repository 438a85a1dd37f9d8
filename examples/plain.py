"""Plain attention: softmax(q @ k^T / sqrt(D)) @ v, no score or mask modification."""

import falower as fl

graph = fl.attention(name="plain")
