"""falower inside other libraries' models. Each integration is a module imported on its own, so that
`import falower` and `import falower.integrations` import neither torch nor the library:

    import falower.integrations.transformers as fl_hf
    fl_hf.register()                                   # attn_implementation="falower"
"""
