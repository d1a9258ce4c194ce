"""Small chat templates with the tool-calling parts of the real Qwen3.5 and Gemma 4 templates: tools listed in a
system turn, the assistant's earlier calls rendered in the model's own call format, tool answers fed back."""

QWEN_XML = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}
</tools>
Call a function like this:
<tool_call>
<function=NAME>
<parameter=KEY>
VALUE
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{{ m.content or '' }}
{%- for c in m.tool_calls %}<tool_call>
<function={{ c.function.name }}>
{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>
{{ v if v is string else v | tojson }}
</parameter>
{% endfor %}</function>
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

GEMMA4 = """{{ bos_token }}
{%- if tools %}<|turn>system
{% for t in tools %}<|tool>declaration:{{ t.function.name }}{{ t.function.parameters | tojson }}<tool|>{% endfor %}<turn|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}<|turn>model
{% for c in (m.tool_calls or []) %}<|tool_call>call:{{ c.function.name }}{
{%- for k, v in c.function.arguments.items() %}{{ k }}:{% if v is string %}<|"|>{{ v }}<|"|>{% else %}{{ v | tojson }}{% endif %}{% if not loop.last %},{% endif %}{% endfor %}}<tool_call|>{% endfor %}{{ m.content or '' }}<turn|>
{% elif m.role == 'tool' %}<|turn>user
<|tool_response>response:{{ m.name }}{value:<|"|>{{ m.content }}<|"|>}<tool_response|><turn|>
{% else %}<|turn>{{ m.role }}
{{ m.content }}<turn|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|turn>model
{% endif %}"""

# The thinking parts of the Qwen3.5 and Gemma 4 templates: Qwen3.5 opens `<think>` in the generation prompt unless
# enable_thinking is false (then an empty block), and renders an earlier answer's reasoning_content; Gemma 4 asks
# for thinking with `<|think|>` in a system turn when enable_thinking is true.
QWEN_THINKING = """{%- for m in messages %}
{%- if m.role == 'assistant' %}<|im_start|>assistant
{% if m.reasoning_content is string %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content or '' }}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""

GEMMA4_THINKING = """{{ bos_token }}
{%- if enable_thinking is defined and enable_thinking %}<|turn>system
<|think|><turn|>
{% endif %}
{%- for m in messages %}<|turn>{{ 'model' if m.role == 'assistant' else m.role }}
{{ m.content }}<turn|>
{% endfor %}
{%- if add_generation_prompt %}<|turn>model
{% endif %}"""
