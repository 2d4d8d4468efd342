"""FX passes of deft_compile, installed as ``deft_compile.passes``.

Every pass is a plain function ``GraphModule -> GraphModule`` that matches nodes
by op overload (never by node name). The passes run in the order listed by the
policy that uses them.
"""
